"""A test double of ROLL (alibaba/ROLL at commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a).

This package is NOT ROLL's code. It was written for roll-ckpt's tests, because ROLL is not
on PyPI and CI cannot install it. Put ``tests/integration_roll/roll_double`` on
``sys.path``/``PYTHONPATH`` and ``import roll`` finds it.

What is faithful to ROLL (same module paths, class names, method names, signatures, call
order and on-disk results), for everything that touches checkpoints:

* ``roll.distributed.strategy.fsdp2_strategy``: ``FSDP2StrategyBase`` (``save_checkpoint``,
  ``load_checkpoint``, ``_save_checkpoint_with_dcp``, ``_load_checkpoint_with_dcp``,
  ``_get_dcp_process_group``, ``get_rng_state``/``load_rng_state``, ``load_states``/
  ``offload_states``, ``unwrap_model``) and ``FSDP2TrainStrategy.initialize`` (FSDP2 over a
  1-D mesh, AdamW over the trainable parameters, ``transformers.get_scheduler``);
  ``roll.distributed.strategy.strategy``: ``InferenceStrategy``/``TrainStrategy.__init__``.
* ``roll.pipeline.base_worker``: ``ActorWorker``/``CriticWorker`` ``initialize`` (resume
  block) and ``do_checkpoint`` (save_dir, local_state_path, is_last_step).
* ``roll.pipeline.base_pipeline.BasePipeline``: resume resolution, the class-level
  ``checkpoint_clusters`` list, ``do_checkpoint``, ``_cleanup_old_checkpoints``.
* ``roll.utils``: ``CheckpointManager.upload``, ``get_latest_ckpt``, ``download_model`` (local
  folders), ``FileSystemUploader``, ``WorkerState``.
* ``roll.configs``: ``BaseConfig.__post_init__`` (timestamp folder appended to
  ``checkpoint_config["output_dir"]``, ``async_upload`` forced off for ``resume_from_checkpoint
  is True``, one ``checkpoint_config`` dict shared by every worker config).
* ``roll.distributed.executor``: one Ray actor per rank, env vars ``WORLD_SIZE``, ``RANK``,
  ``CLUSTER_NAME``, ``WORKER_NAME`` (``<cluster>-<rank>`` on CPU), ``MASTER_ADDR``/``PORT``
  picked by rank 0; calls dispatched to every rank (``blocking`` as ROLL's ``func_generator``).

So, with roll-ckpt's integration off, it writes ROLL's tree (HF files of rank 0's
``save_pretrained`` + ``dcp/`` at the step, ``critic/`` below it, ``pipeline/``) with ROLL's DCP
keys, and its ``load_checkpoint`` has ROLL's semantics, bugs included: parameters, scheduler
and optimizer param_groups come back, Adam's state and the RNG do not.

What is simplified: CPU and gloo only (no CUDA call; the "device" RNG entry is ``None``);
fp32, no mixed precision, LoRA, Ulysses, expert parallelism or legacy shard loading; no
placement groups, resource manager, tracker, telemetry, shared-storage actor or model hub
(``download_model`` accepts local folders only); ``DataProto`` is a plain dict
(``{"metrics": {...}}``); the model providers live in ``roll.pipeline.base_worker``; every
rank builds the model from the folder and rank 0's weights are broadcast (ROLL builds on the
meta device and broadcasts rank 0's); a toy loss stands in for PPO (``train_step``), and a
toy pipeline (``roll.pipeline.toy_pipeline``) for RLVRPipeline. Where ROLL crashes (the
missing ``checkpoint_future`` with ``async_save_ckpt: false``, ``get_latest_ckpt`` on a
timestamp folder that does not exist yet, the critic's ``os.path.join(None, ...)``) the
double does not; a comment at each place says what ROLL does.
"""

import os

# As ROLL's roll/__init__.py: set before ray is imported.
os.environ["RAY_DEDUP_LOGS"] = os.getenv("RAY_DEDUP_LOGS", "1")
