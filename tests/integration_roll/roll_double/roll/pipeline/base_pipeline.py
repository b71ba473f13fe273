"""roll/pipeline/base_pipeline.py: BasePipeline, the driver side of checkpoints (resume
resolution, the clusters to save, do_checkpoint, _cleanup_old_checkpoints). No tracker,
telemetry, resource manager or model-update groups."""

import logging
import os
import re
import shutil
from concurrent import futures
from typing import List

from transformers import set_seed

from roll.distributed.scheduler.protocol import DataProto
from roll.utils.checkpoint_manager import CheckpointManager, download_model, get_latest_ckpt
from roll.utils.functionals import reduce_metrics
from roll.utils.worker_state import WorkerState

logger = logging.getLogger("roll")


class BasePipeline:
    # Class-level lists, as in ROLL: every pipeline of a process appends to the SAME list, so a
    # second pipeline built in one process also saves the first one's clusters. Tests that
    # build several pipelines in one process call BasePipeline.reset_class_lists() between.
    model_update_groups: List = []
    checkpoint_clusters: List = []

    @classmethod
    def reset_class_lists(cls):
        """Test helper (not in ROLL): empty the shared class-level lists."""
        BasePipeline.model_update_groups.clear()
        BasePipeline.checkpoint_clusters.clear()

    def __init__(self, pipeline_config):
        set_seed(seed=pipeline_config.seed)
        self.pipeline_config = pipeline_config
        self.resource_manager = None
        self.state = WorkerState()
        self.checkpoint_manager = CheckpointManager(checkpoint_config=self.pipeline_config.checkpoint_config)

        self.resume_from_checkpoint = False
        self.executor: futures.ThreadPoolExecutor = futures.ThreadPoolExecutor(max_workers=5)
        self.resume_futures = []

        if self.pipeline_config.resume_from_checkpoint:
            if self.pipeline_config.resume_from_checkpoint is True:
                latest_ckpt = get_latest_ckpt(self.pipeline_config.checkpoint_config)
                self.resume_from_checkpoint = download_model(latest_ckpt) if latest_ckpt else False
            elif isinstance(self.pipeline_config.resume_from_checkpoint, str):
                self.resume_from_checkpoint = download_model(self.pipeline_config.resume_from_checkpoint)

        if self.resume_from_checkpoint:
            logger.info(f"resume_from_checkpoint: {self.resume_from_checkpoint}")
            load_dir = os.path.join(self.resume_from_checkpoint, "pipeline")
            self.state = WorkerState.load_from_json(load_dir=load_dir, tag="pipeline")
            # ROLL also replays self.state.log_history into its tracker here (resume_futures).

    def run(self):
        pass

    def set_checkpoint_clusters(self, *clusters):
        self.checkpoint_clusters.extend(clusters)

    def do_checkpoint(self, global_step, is_last_step=None):
        if is_last_step is None:
            is_last_step = global_step == self.pipeline_config.max_steps - 1

        metrics = self.state.log_history[-1]
        metrics["system/step"] = global_step
        if global_step > 0 and (
            global_step % self.pipeline_config.save_steps == 0 or global_step == self.pipeline_config.max_steps - 1
        ):
            ckpt_metrics_refss = []
            for cluster in self.checkpoint_clusters:
                ckpt_metrics_refss.append(
                    cluster.do_checkpoint(global_step=global_step, is_last_step=is_last_step, blocking=False)
                )
            for ckpt_metrics_refs in ckpt_metrics_refss:
                ckpt_metrics = DataProto.materialize_concat(data_refs=ckpt_metrics_refs)
                metrics.update(reduce_metrics(ckpt_metrics.meta_info.pop("metrics", {})))

            ckpt_id = f"checkpoint-{global_step}"
            pipeline_save_dir = os.path.join(self.pipeline_config.output_dir, "pipeline", ckpt_id)
            save_dir = os.path.join(self.pipeline_config.output_dir, "pipeline", ckpt_id, "pipeline")
            self.state.save_to_json(save_dir=save_dir, tag="pipeline")
            self.state.save_rng_state(save_dir=save_dir, tag="pipeline")

            if self.pipeline_config.checkpoint_config.get("async_upload", True) and not is_last_step:
                self.executor.submit(self.checkpoint_manager.upload, ckpt_id=ckpt_id, local_state_path=pipeline_save_dir)
            else:
                self.checkpoint_manager.upload(ckpt_id=ckpt_id, local_state_path=pipeline_save_dir)

            self._cleanup_old_checkpoints()

        futures.wait(self.resume_futures)
        self.resume_futures.clear()

    def _cleanup_old_checkpoints(self):
        """Keeps the newest max_ckpt_to_keep steps of every subfolder of the LOCAL output_dir
        (the uploaded copies are not touched); 0 keeps all."""
        max_ckpt = getattr(self.pipeline_config, "max_ckpt_to_keep", 0)
        if max_ckpt <= 0:
            return
        output_dir = self.pipeline_config.output_dir
        if not os.path.exists(output_dir):
            return
        ckpt_pattern = re.compile(r"^checkpoint-(\d+)$")
        all_ckpt_steps = set()
        for subdir in os.listdir(output_dir):
            subdir_path = os.path.join(output_dir, subdir)
            if not os.path.isdir(subdir_path):
                continue
            for item in os.listdir(subdir_path):
                match = ckpt_pattern.match(item)
                if match:
                    all_ckpt_steps.add(int(match.group(1)))
        steps_to_delete = sorted(all_ckpt_steps, reverse=True)[max_ckpt:]
        if not steps_to_delete:
            return
        for subdir in os.listdir(output_dir):
            subdir_path = os.path.join(output_dir, subdir)
            if not os.path.isdir(subdir_path):
                continue
            for step in steps_to_delete:
                ckpt_dir = os.path.join(subdir_path, f"checkpoint-{step}")
                if os.path.exists(ckpt_dir):
                    try:
                        shutil.rmtree(ckpt_dir)
                    except Exception as e:
                        logger.warning(f"Failed to delete checkpoint {ckpt_dir}: {e}")
