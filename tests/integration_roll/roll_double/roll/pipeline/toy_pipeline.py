"""A toy pipeline (not in ROLL) standing in for roll/pipeline/rlvr/rlvr_pipeline.py's
RLVRPipeline, with its checkpoint-relevant order: clusters built and initialized, then
``set_checkpoint_clusters``; each step trains, updates ``self.state`` and calls
``do_checkpoint``; steps up to ``self.state.step`` are skipped on resume."""

from concurrent import futures

import ray

from roll.distributed.executor.cluster import Cluster
from roll.pipeline.base_pipeline import BasePipeline
from roll.pipeline.base_worker import ActorWorker, CriticWorker


class ToyPipeline(BasePipeline):
    def __init__(self, pipeline_config):
        super().__init__(pipeline_config)
        self.pipeline_config.set_max_steps(max_steps=self.pipeline_config.max_steps)

        self.actor_train = Cluster(name=self.pipeline_config.actor_train.name, worker_cls=ActorWorker,
                                   resource_manager=self.resource_manager, worker_config=self.pipeline_config.actor_train)
        self.critic = None
        if self.pipeline_config.critic is not None:     # ROLL: adv_estimator == "gae"
            self.critic = Cluster(name=self.pipeline_config.critic.name, worker_cls=CriticWorker,
                                  resource_manager=self.resource_manager, worker_config=self.pipeline_config.critic)

        refs = []
        refs.extend(self.actor_train.initialize(pipeline_config=self.pipeline_config, blocking=False))
        if self.critic is not None:
            refs.extend(self.critic.initialize(pipeline_config=self.pipeline_config, blocking=False))
        ray.get(refs)

        if self.critic is not None:
            self.set_checkpoint_clusters(self.actor_train, self.critic)
        else:
            self.set_checkpoint_clusters(self.actor_train)

    @property
    def clusters(self):
        return [c for c in (self.actor_train, self.critic) if c is not None]

    def run(self):
        for global_step in range(self.pipeline_config.max_steps):
            if global_step <= self.state.step:
                continue
            batch = {"global_step": global_step}
            metrics = {}
            critic_refs = self.critic.train_step(batch, blocking=False) if self.critic is not None else None
            actor_out = ray.get(self.actor_train.train_step(batch, blocking=False))[0]    # rank 0's, as ROLL
            metrics.update(actor_out["metrics"])
            if critic_refs is not None:
                metrics.update(ray.get(critic_refs)[0]["metrics"])

            # ROLL: state.kv["scheduler_state_<domain>"] = generate_scheduler.get_scheduler_state()
            scheduler_state = dict(self.state.kv.get("scheduler_state_default") or {"dataset_iter_count": 0})
            scheduler_state["dataset_iter_count"] += 1
            self.state.kv["scheduler_state_default"] = scheduler_state

            self.state.step = global_step
            self.state.log_history.append(metrics)
            self.do_checkpoint(global_step=global_step)

    def wait_for_checkpoint_uploads(self):
        """Test helper (not in ROLL): wait for every upload started so far (workers' and driver's)."""
        for cluster in self.clusters:
            cluster.wait_for_checkpoint_uploads()
        self.executor.shutdown(wait=True)
        self.executor = futures.ThreadPoolExecutor(max_workers=5)

    def shutdown(self):
        """Test helper (not in ROLL): kill the clusters' actors."""
        for cluster in self.clusters:
            cluster.kill()
