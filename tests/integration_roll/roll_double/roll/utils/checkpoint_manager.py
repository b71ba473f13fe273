"""roll/utils/checkpoint_manager.py: CheckpointManager, get_latest_ckpt, download_model."""

import copy
import logging
import os
import shutil
import traceback
from typing import Dict, Optional

from roll.utils.upload_utils import uploader_registry

logger = logging.getLogger("roll")


def get_latest_ckpt(checkpoint_config):
    if not checkpoint_config:
        return None
    upload_type = checkpoint_config.get("type", None)
    if not upload_type:
        return None
    if upload_type not in uploader_registry:
        raise ValueError(f"Unknown tracker name: {upload_type}, total registered trackers: {uploader_registry.keys()}")
    uploader = uploader_registry[upload_type](**checkpoint_config)
    return uploader.get_latest_ckpt()


def download_model(model_name_or_path: str, local_dir: Optional[str] = None):
    """ROLL returns a local folder as is and downloads anything else (ModelScope/HF hub,
    cached per node in a shared-storage actor). The double knows local folders only."""
    if os.path.isdir(model_name_or_path):
        return model_name_or_path
    raise FileNotFoundError(f"roll double: {model_name_or_path} is not a local folder (no model hub here)")


class CheckpointManager:
    """Uploads a worker's local checkpoint folder to the configured storage, then removes the
    local copy unless ``keep_local_file``. Upload errors are printed and swallowed, as in ROLL."""

    def __init__(self, checkpoint_config=None):
        self.checkpoint_config: Dict = copy.deepcopy(checkpoint_config)
        self.uploader = None
        if self.checkpoint_config:
            upload_type = self.checkpoint_config.pop("type", "file_system")
            if upload_type not in uploader_registry:
                raise ValueError(f"Unknown tracker name: {upload_type}, total registered trackers: {uploader_registry.keys()}")
            self.uploader = uploader_registry[upload_type](**self.checkpoint_config)

    def upload(self, ckpt_id, local_state_path, keep_local_file=False):
        try:
            if not self.uploader:
                logger.warning("uploader is None, skip upload...")
                return
            self.uploader.upload(ckpt_id=ckpt_id, local_state_path=local_state_path)
            if not keep_local_file:
                if os.path.isdir(local_state_path):
                    shutil.rmtree(local_state_path, ignore_errors=True)
                else:
                    os.remove(local_state_path)
        except Exception as e:
            traceback.print_exc()
            logger.error(f"upload failed, {e}")
