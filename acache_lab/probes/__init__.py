"""One-off diagnostics behind the docs' findings, each runnable as ``python -m acache_lab.probes.<name>``.

They read engine internals on purpose (a probe measures one piece in isolation), so they live in the lab,
not the runtime; the docs cite each by its module.
"""
