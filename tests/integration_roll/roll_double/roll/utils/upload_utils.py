"""roll/utils/upload_utils.py: the file_system uploader."""

import logging
import os
import re
import shutil

logger = logging.getLogger("roll")

uploader_registry = {}


class FileSystemUploader:
    """Copies a local checkpoint folder into ``<output_dir>/<ckpt_id>/`` (merging with what
    other workers already copied there)."""

    def __init__(self, output_dir, *args, **kwargs):
        self.output_dir = output_dir
        self._re_checkpoint = re.compile(r"^checkpoint\-(\d+)$")

    def upload(self, ckpt_id: str, local_state_path: str, **kwargs):
        ckpt_id_output_dir = os.path.join(self.output_dir, ckpt_id)
        os.makedirs(ckpt_id_output_dir, exist_ok=True)
        logger.info(f"{local_state_path} save to {ckpt_id_output_dir}")
        shutil.copytree(local_state_path, ckpt_id_output_dir, dirs_exist_ok=True)

    def get_latest_ckpt(self):
        # ROLL calls os.listdir(self.output_dir) unguarded. output_dir carries this launch's
        # timestamp folder, which does not exist yet at resume time, so ROLL raises
        # FileNotFoundError there (resume_from_checkpoint=True never finds an earlier launch's
        # checkpoint). The double returns None instead of crashing.
        if not os.path.isdir(self.output_dir):
            return None
        checkpoints = [
            path
            for path in os.listdir(self.output_dir)
            if self._re_checkpoint.search(path) is not None and os.path.isdir(os.path.join(self.output_dir, path))
        ]
        if not checkpoints:
            return None
        newest = max(checkpoints, key=lambda x: int(self._re_checkpoint.search(x).groups()[0]))
        return os.path.join(self.output_dir, newest)


uploader_registry["file_system"] = FileSystemUploader
