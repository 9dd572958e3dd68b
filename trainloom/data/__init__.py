"""trainloom.data."""

from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler  # noqa: E402,F401
