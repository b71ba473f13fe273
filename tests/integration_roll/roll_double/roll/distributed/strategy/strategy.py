"""roll/distributed/strategy/strategy.py: the strategy base classes, reduced to what their
__init__ sets up for checkpoints (thread_executor, checkpoint_manager, optimizer, scheduler)."""

from abc import ABC
from concurrent import futures

from roll.utils.checkpoint_manager import CheckpointManager


class InferenceStrategy(ABC):
    strategy_name = None

    def __init__(self, worker):
        self.worker = worker
        self.model = None
        self.tokenizer = None
        self.running = False
        self.worker_config = self.worker.worker_config
        # Where save_checkpoint runs asynchronous uploads.
        self.thread_executor: futures.ThreadPoolExecutor = futures.ThreadPoolExecutor(max_workers=5)
        self.offload_nccl = self.worker_config.offload_nccl

    def initialize(self, *args, **kwargs):
        raise NotImplementedError


class TrainStrategy(InferenceStrategy):
    def __init__(self, worker):
        super().__init__(worker)
        self.optimizer = None
        self.scheduler = None
        self.checkpoint_manager = CheckpointManager(checkpoint_config=self.worker_config.checkpoint_config)
