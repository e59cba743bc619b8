"""Scale-out on Ray Serve: engine replicas behind a router that sends a request to the replica holding its
shared spans (affixes at any position), not only its prefix.

``directory`` and ``affinity`` are plain Python (the map of who holds what, and the routing rule); ``router``,
``replica``, ``frontend`` and ``launch`` need Ray Serve (``pip install -e '.[cluster]'``).
"""
