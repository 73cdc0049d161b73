"""Scale-out: Switchyard as a Ray Serve application (ray_app.py) and its Serve config
and KubeRay manifest (serve_config.py)."""
