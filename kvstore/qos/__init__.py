"""Quality of service between tenants: each tenant's rates and weight
(policy.py), the node-wide token buckets that hold its limits across
workers (buckets.py), and the weighted fair gate its bulk transfers pass
in each worker (fair.py). The transports apply them
(kvstore/transport/http/qos.py)."""
