"""The research side of acache: the task suite, the trainer of the shipped model, the studies and the
benchmarks. It is a user of the runtime (``acache``) and is never imported by it; its commands join the
``acache`` command line through the ``acache.commands`` entry point."""
