"""Config dataclasses standing in for ROLL's (roll/configs/{model_args,training_args,
worker_config,base_config}.py), with only the fields the checkpoint code, the FSDP2 strategy
and the toy pipeline read. ``BaseConfig.__post_init__`` keeps ROLL's checkpoint logic."""

import dataclasses
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Dict, Optional, Union


@dataclass
class ModelArguments:
    """roll/configs/model_args.py."""

    model_name_or_path: Optional[str] = None
    lora_target: Optional[str] = None
    ulysses_size: int = 1
    num_labels: int = 1                      # the critic's head (AutoModelForTokenClassification)
    model_config_kwargs: dict = field(default_factory=dict)


@dataclass
class TrainingArguments:
    """roll/configs/training_args.py."""

    output_dir: str = ""
    max_steps: int = -1                      # optimizer steps over all dp ranks (ROLL's set_max_steps)
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    per_device_train_batch_size: int = 2
    gradient_accumulation_steps: int = 1
    seed: int = 42
    warmup_ratio: float = 0.0
    warmup_steps: int = 0

    def get_warmup_steps(self, num_training_steps: int):
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(num_training_steps * self.warmup_ratio)


@dataclass
class StrategyArguments:
    """roll/configs/worker_config.py: StrategyArguments (only "fsdp2_train" here)."""

    strategy_name: str = "fsdp2_train"
    strategy_config: Optional[Dict] = None   # async_save_ckpt (default True), save_only_model, offload_policy

    def __post_init__(self):
        if self.strategy_config is None:
            self.strategy_config = {}


@dataclass
class WorkerConfig:
    """roll/configs/worker_config.py: WorkerConfig. ``checkpoint_config`` is not a field: as in
    ROLL, ``__post_init__`` sets it to None and the pipeline config puts its own dict there."""

    name: Optional[str] = None
    model_args: ModelArguments = field(default_factory=ModelArguments)
    training_args: TrainingArguments = field(default_factory=TrainingArguments)
    strategy_args: StrategyArguments = field(default_factory=StrategyArguments)
    world_size: int = 1
    device_mapping: Optional[str] = None
    system_envs: dict = field(default_factory=dict)
    offload_nccl: bool = False
    max_concurrency: int = 1

    def __post_init__(self):
        self.offload_nccl = False            # ROLL forces it off too
        self.resource_placement_groups = None
        self.checkpoint_config: Optional[Dict] = None


@dataclass
class BaseConfig:
    """roll/configs/base_config.py: BaseConfig (the checkpoint fields)."""

    exp_name: str = "roll_double"
    seed: int = 42
    output_dir: str = "./output"
    max_steps: int = 500
    save_steps: int = 50
    max_ckpt_to_keep: int = 0
    max_grad_norm: float = 1.0
    resume_from_checkpoint: Union[bool, str] = False
    checkpoint_config: Optional[Dict] = field(default_factory=dict)

    def to_dict(self):
        return dataclasses.asdict(self)

    def __post_init__(self):
        # As ROLL: only the file_system uploader gets the launch's timestamp folder, so every
        # launch writes under a new <output_dir>/<YYYYmmdd-HHMMSS>/.
        upload_type = self.checkpoint_config.get("type", None)
        if upload_type == "file_system":
            output_dir = self.checkpoint_config.get("output_dir")
            self.checkpoint_config["output_dir"] = os.path.join(output_dir, datetime.now().strftime("%Y%m%d-%H%M%S"))
        if self.resume_from_checkpoint is True:
            self.checkpoint_config["async_upload"] = False
        # One dict shared by every worker config (ROLL setattr's the same object).
        for attribute_name in dir(self):
            attribute = getattr(self, attribute_name)
            if isinstance(attribute, WorkerConfig):
                attribute.checkpoint_config = self.checkpoint_config
                attribute.training_args.seed = self.seed


@dataclass
class PPOConfig(BaseConfig):
    """roll/configs/base_config.py: PPOConfig, reduced to its trained clusters. ROLL trains a
    critic when ``adv_estimator == "gae"``; here when ``critic`` is set."""

    actor_train: WorkerConfig = field(default_factory=WorkerConfig)
    critic: Optional[WorkerConfig] = None

    def __post_init__(self):
        super().__post_init__()
        self.actor_train.name = "actor_train"
        self.actor_train.training_args.output_dir = self.output_dir
        if self.critic is not None:
            self.critic.name = "critic"
            self.critic.training_args.output_dir = self.output_dir

    def set_max_steps(self, max_steps: int):
        """ROLL's set_max_steps: the workers' max_steps count backward batches over all dp
        ranks (FSDP2TrainStrategy.initialize divides by dp_size). The toy pipeline trains one
        batch per rank per step."""
        for worker_config in (self.actor_train, self.critic):
            if worker_config is not None:
                worker_config.training_args.max_steps = max(1, max_steps * worker_config.world_size)
        self.max_steps = max_steps
