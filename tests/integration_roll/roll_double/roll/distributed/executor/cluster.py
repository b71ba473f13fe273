"""roll/distributed/executor/cluster.py: Cluster, one Ray actor per rank of a worker class,
and the methods that call every rank (ROLL's Dispatch.ONE_TO_ALL + func_generator)."""

import os
from typing import Any, List

import ray

RAY_NAMESPACE = "roll"      # roll/utils/constants.py
NUM_CPUS_PER_WORKER = 0.01  # as ROLL: the actors hold next to no CPU, so many fit on 2 cores


class Cluster:
    """Creates ``worker_config.world_size`` actors of ``worker_cls`` (rank 0 first, then the
    others with rank 0's MASTER_ADDR/PORT in their env), named ``<cluster>-<rank>``.

    Every public method of the worker class becomes a method here that calls it on all ranks
    with the same arguments: ``blocking=True`` (default) returns the list of results,
    ``blocking=False`` the list of ObjectRefs. ``resource_manager`` (ROLL's placement groups)
    is not used."""

    def __init__(self, name, worker_cls, resource_manager=None, worker_config=None):
        self.cluster_name = name
        self.worker_cls = worker_cls if hasattr(worker_cls, "__ray_actor_class__") else ray.remote(worker_cls)
        self.resource_manager = resource_manager
        self.worker_config = worker_config
        self.world_size = worker_config.world_size
        self.workers: List[Any] = []
        self.master_addr = None
        self.master_port = None
        self.initialized = False
        self._create_workers()
        self._bind_worker_method()
        del self.worker_cls             # as ROLL: the Cluster object can then travel over Ray

    @property
    def dp_size(self):
        return self.world_size

    def _create_workers(self):
        for rank in range(self.world_size):
            worker_name = f"{self.cluster_name}-{rank}"    # ROLL's name of a CPU-only worker
            env_vars = {
                "WORLD_SIZE": str(self.world_size),
                "RANK": str(rank),
                "LOCAL_RANK": str(0),
                "CLUSTER_NAME": self.cluster_name,
                "WORKER_NAME": worker_name,
            }
            if rank != 0:
                env_vars["MASTER_ADDR"] = self.master_addr
                env_vars["MASTER_PORT"] = str(self.master_port)
            if "PYTHONPATH" in os.environ:       # not in ROLL: the workers must import this double
                env_vars["PYTHONPATH"] = os.environ["PYTHONPATH"]
            env_vars.update(self.worker_config.system_envs)
            worker = self.worker_cls.options(
                name=worker_name,
                namespace=RAY_NAMESPACE,
                runtime_env={"env_vars": env_vars},
                num_cpus=NUM_CPUS_PER_WORKER,
                max_concurrency=1,
            ).remote(worker_config=self.worker_config)
            self.workers.append(worker)
            if rank == 0:
                self.master_addr, self.master_port = ray.get(worker.get_master_addr_and_port.remote())

    def _bind_worker_method(self):
        worker_cls = self.worker_cls.__ray_metadata__.modified_class
        for method_name in dir(worker_cls):
            if method_name.startswith("_") or hasattr(self, method_name):
                continue
            if not callable(getattr(worker_cls, method_name, None)):
                continue
            setattr(self, method_name, self._func_generator(method_name))

    def _func_generator(self, method_name):
        def func(*args, blocking=True, **kwargs):
            if method_name == "initialize":
                self.initialized = True
            refs = self.execute_all_async(method_name, *args, **kwargs)
            return ray.get(refs) if blocking else refs

        func.__name__ = method_name
        return func

    def execute_all_async(self, method_name: str, *args, **kwargs):
        return [getattr(worker, method_name).remote(*args, **kwargs) for worker in self.workers]

    def execute_all(self, method_name: str, *args, **kwargs):
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_all_sync(self, method_name: str, *args, **kwargs):
        return ray.get(self.execute_all_async(method_name, *args, **kwargs))

    def execute_rank_zero_async(self, method_name: str, *args, **kwargs):
        return getattr(self.workers[0], method_name).remote(*args, **kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args, **kwargs):
        return ray.get(self.execute_rank_zero_async(method_name, *args, **kwargs))

    def kill(self):
        """Test helper (not in ROLL): kill every rank's actor."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
