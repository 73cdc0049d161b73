"""Scale: every core of one host (`serve --workers N`: the supervisor and control plane
in workers.py, one worker in worker.py, the private redis-server in private_redis.py),
and Switchyard as a Ray Serve application (ray_app.py) with its Serve config and KubeRay
manifest (serve_config.py)."""
