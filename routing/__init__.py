"""The data plane: the /v1 proxy, the in-memory worker snapshot and the balancing policies.

Nothing here imports the ORM; the control plane hands the router a snapshot source.
"""
