"""roll/distributed/executor/worker.py: Worker, the plain class each Ray actor runs (the
Cluster wraps it with ``ray.remote``), and RankInfo."""

import logging
import os
import socket
from concurrent import futures
from dataclasses import dataclass


@dataclass
class RankInfo:
    world_size: int = 1
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1

    rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0


class Worker:
    """Reads its identity from the environment the Cluster gave the actor (``CLUSTER_NAME``,
    ``WORKER_NAME``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); rank 0 picks ``MASTER_ADDR``/
    ``MASTER_PORT`` for the group's rendezvous, the other ranks get them in their env."""

    def __init__(self, worker_config):
        self.worker_config = worker_config
        self.pipeline_config = None
        self.worker_name = os.environ.get("WORKER_NAME", None)
        self.cluster_name = os.environ.get("CLUSTER_NAME", None)
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))

        if self.rank == 0:
            # ROLL: get_node_ip() and a port reserved through its SharedStorage actor.
            os.environ["MASTER_ADDR"] = self.get_node_ip()
            os.environ["MASTER_PORT"] = str(self.get_free_port())
        self.master_addr = os.environ["MASTER_ADDR"]
        self.master_port = int(os.environ["MASTER_PORT"])

        self.rank_info = RankInfo(world_size=self.world_size, rank=self.rank, dp_rank=self.rank, dp_size=self.world_size)
        self.thread_executor: futures.ThreadPoolExecutor = futures.ThreadPoolExecutor(max_workers=5)

    def __repr__(self):
        return f"{type(self).__name__}({self.worker_name})"

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger("roll")

    @staticmethod
    def get_node_ip():
        import ray

        return ray.util.get_node_ip_address()

    @staticmethod
    def get_free_port():
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def get_master_addr_and_port(self):
        return self.master_addr, self.master_port

    def get_rank_info(self):
        return self.rank_info

    def initialize(self, pipeline_config, *args, **kwargs):
        self.pipeline_config = pipeline_config
