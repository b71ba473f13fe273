"""roll/utils/worker_state.py: the pipeline's (driver's) state, saved as JSON, and its RNG."""

import dataclasses
import json
import os
import random
from dataclasses import dataclass
from typing import Dict, List, Union

import numpy as np
import torch

WORKER_STATE_NAME = "worker_state_{tag}.json"


@dataclass
class WorkerState:
    step: int = -1
    log_history: List[Dict[str, float]] = None
    kv: Dict[str, Union[float, Dict]] = None

    def __post_init__(self):
        if self.log_history is None:
            self.log_history = []
        if self.kv is None:
            self.kv = {}

    def save_to_json(self, save_dir: str, tag):
        json_path = os.path.join(save_dir, WORKER_STATE_NAME.format(tag=tag))
        json_string = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"
        os.makedirs(os.path.dirname(json_path), exist_ok=True)
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(json_string)

    @classmethod
    def load_from_json(cls, load_dir: str, tag):
        json_path = os.path.join(load_dir, WORKER_STATE_NAME.format(tag=tag))
        with open(json_path, "r", encoding="utf-8") as f:
            return cls(**json.loads(f.read()))

    @staticmethod
    def save_rng_state(save_dir, tag):
        # ROLL's dict is {"python", "numpy", "cpu": torch RNG, <device_type>: device RNG}; on the
        # CPU platform <device_type> is "cpu" again, so the literal keeps one "cpu" entry. (ROLL
        # reads it from current_platform.random.get_rng_state_all(); torch.cpu has no such
        # function, the double stores torch's CPU RNG there.) ROLL never loads this file.
        rng_states = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
        }
        os.makedirs(save_dir, exist_ok=True)
        torch.save(rng_states, os.path.join(save_dir, f"rng_state_{tag}.pth"))

    @staticmethod
    def load_rng_state(load_dir, tag):
        if load_dir is None:
            return
        rng_file = os.path.join(load_dir, f"rng_state_{tag}.pth")
        if not os.path.isfile(rng_file):
            return
        state = torch.load(rng_file, weights_only=False)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.random.set_rng_state(state["cpu"])
