"""The load test's parts; scripts/bench.py is its entry point (a sweep of N paced callers through a server).

- callers.py: the load: paced callers over the native WebSocket protocol, uploads and arriving calls beside them
- metrics.py: the server's side, sampled from GET /metrics and nvidia-smi during a run
- judging.py: a run's latency and real-time verdict from what its callers saw
- report.py: the results files, plots and W&B scalars of a sweep
"""
