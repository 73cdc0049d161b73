"""Media inputs: SSRF-safe fetch and staged preprocessing of images."""
