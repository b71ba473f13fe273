"""roll/distributed/scheduler/initialize.py: init(), which the driver calls before building a
pipeline. ROLL may first ``ray start`` a multi-node cluster; then it calls ``ray.init``
with its namespace and ``runtime_env={"env_vars": <platform env vars>}``. The double starts
a local Ray sized for a 2-core machine, with PYTHONPATH in the env vars so that every
worker imports this double."""

import os

import ray

from roll.distributed.executor.cluster import RAY_NAMESPACE


def init():
    if not ray.is_initialized():
        env_vars = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        ray.init(
            namespace=RAY_NAMESPACE,
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=80 * 2**20,
            runtime_env={"env_vars": env_vars},
            ignore_reinit_error=True,
        )
