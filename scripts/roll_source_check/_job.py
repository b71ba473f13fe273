"""One ROLL launch on a local Ray cluster, the way ROLL's pipelines run: ROLL's BasePipeline, its
Cluster of real ActorWorker (actor_train, 2 ranks) and CriticWorker (critic, 2 ranks) on FSDP2,
ROLL's do_checkpoint; the driver loop of RLVRPipeline.run (skip steps <= state.step, train,
state.step/log_history/kv, do_checkpoint) without rollout (no vLLM on CPU).

    $ROLL_PYTHON _job.py --workdir DIR --ckpt-root DIR --result FILE --integration 0|1
        --max-steps N --save-steps N [--stop-after N] [--resume false|true|PATH] [--step-delay S]

--integration 1 calls roll_ckpt_roll.enable() first, before ray.init (Ray's
worker_process_setup_hook carries it to the worker actors). The result file (JSON, rewritten
after every step) holds: the launch's checkpoint folder, the pipeline state after __init__,
every cluster's digests after __init__ and right before each do_checkpoint, the WorkerState
after each do_checkpoint, timings, worker pids, how the driver ended.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: o.item() if hasattr(o, "item") else repr(o)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--integration", type=int, required=True)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--save-steps", type=int, default=1)
    p.add_argument("--stop-after", type=int, default=None, help="end the launch after training this step")
    p.add_argument("--resume", default="false")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds the driver sleeps after each step")
    p.add_argument("--wait-commit", type=int, default=None,
                   help="(integration) before ending, wait until this step's manifest.json exists")
    a = p.parse_args()

    os.makedirs(a.workdir, exist_ok=True)
    os.chdir(a.workdir)
    os.environ["ROLL_LOG_DIR"] = os.path.join(a.workdir, "output", "logs")
    result: dict = {"argv": sys.argv[1:], "pid": os.getpid(), "steps": {}, "events": []}
    t_start = time.monotonic()

    def write() -> None:
        result["seconds"] = round(time.monotonic() - t_start, 2)
        tmp = a.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(_jsonable(result), f, indent=1)
        os.replace(tmp, a.result)

    def event(what: str) -> None:
        result["events"].append([round(time.monotonic() - t_start, 2), what])
        write()

    if a.integration:
        import roll_ckpt_roll

        roll_ckpt_roll.enable()  # before ROLL's init / ray.init
        event("roll_ckpt_roll.enable()")

    import ray

    from roll_cpu_shims import CPUActorWorker, CPUCriticWorker, apply_cpu_patches
    from _common import build_pipeline_config, make_ppo_batch, make_tiny_model

    from roll.distributed.executor.cluster import Cluster
    from roll.distributed.scheduler.protocol import DataProto
    from roll.pipeline.base_pipeline import BasePipeline
    from roll.utils.functionals import reduce_metrics

    apply_cpu_patches(patch_download_model=False)  # driver: WorkerState.save_rng_state needs the shim
    model_dir = os.path.join(os.path.dirname(a.ckpt_root.rstrip("/")), "tiny_llama")
    make_tiny_model(model_dir)
    resume = {"false": False, "true": True}.get(a.resume.lower(), a.resume)

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=True)
    result["ray_runtime_env"] = ray.get_runtime_context().runtime_env
    event("ray.init")
    # ResourceManager reserves every CPU of a GPU-less node in a placement group, after which ROLL's
    # SharedStorage actor (used by download_model) could never be placed: create it first.
    from roll.distributed.scheduler.storage import SharedStorage
    from roll.utils.constants import RAY_NAMESPACE, STORAGE_NAME

    storage = SharedStorage.options(name=STORAGE_NAME, get_if_exists=True, namespace=RAY_NAMESPACE).remote()
    ray.get(storage.put.remote("ping", 1))

    class CheckPipeline(BasePipeline):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.actor_train = Cluster(name="actor_train", worker_cls=CPUActorWorker,
                                       resource_manager=self.resource_manager, worker_config=cfg.actor_train)
            self.critic = Cluster(name="critic", worker_cls=CPUCriticWorker,
                                  resource_manager=self.resource_manager, worker_config=cfg.critic)
            refs = self.actor_train.initialize(pipeline_config=cfg, blocking=False)
            refs += self.critic.initialize(pipeline_config=cfg, blocking=False)
            ray.get(refs)
            self.set_checkpoint_clusters(self.actor_train, self.critic)

        def digests(self) -> dict:
            return {"actor_train": self.actor_train.state_summary(blocking=True),
                    "critic": self.critic.state_summary(blocking=True)}

        def run(self):
            for global_step in range(self.pipeline_config.max_steps):
                if global_step <= self.state.step:
                    continue
                if a.stop_after is not None and global_step > a.stop_after:
                    break
                t0 = time.monotonic()
                metrics = {}
                for cluster in (self.actor_train, self.critic):
                    refs = cluster.train_step(make_ppo_batch(global_step), blocking=False)
                    out = DataProto.materialize_concat(data_refs=refs)
                    metrics.update(reduce_metrics(out.meta_info.pop("metrics", {})))
                self.state.step = global_step
                self.state.log_history.append(metrics)
                self.state.kv["check/consumed_batches"] = global_step + 1
                self.state.kv["check/nested"] = {"step": global_step, "tag": f"s{global_step}"}
                step = {"train_s": round(time.monotonic() - t0, 3), "digests": self.digests()}
                result["steps"][str(global_step)] = step
                write()
                t0 = time.monotonic()
                self.do_checkpoint(global_step=global_step)
                step["do_checkpoint_s"] = round(time.monotonic() - t0, 3)
                step["state_after_checkpoint"] = _jsonable(dataclasses.asdict(self.state))
                event(f"step {global_step} done")
                if a.step_delay:
                    time.sleep(a.step_delay)

    pipeline = None
    code = 0
    try:
        cfg = build_pipeline_config(model_dir, os.path.join(a.workdir, "output"), a.ckpt_root,
                                    max_steps=a.max_steps, save_steps=a.save_steps, resume_from=resume)
        result["checkpoint_output_dir"] = cfg.checkpoint_config["output_dir"]
        BasePipeline.checkpoint_clusters = []  # a class-level list in ROLL
        t0 = time.monotonic()
        pipeline = CheckPipeline(cfg)
        result["init_s"] = round(time.monotonic() - t0, 2)
        result["resume_from_checkpoint"] = {"pipeline.resume_from_checkpoint": pipeline.resume_from_checkpoint,
                                            "config": cfg.resume_from_checkpoint}
        result["state_after_init"] = _jsonable(dataclasses.asdict(pipeline.state))
        result["digests_after_init"] = pipeline.digests()
        result["worker_pids"] = {c.cluster_name: [d["pid"] for d in result["digests_after_init"][c.cluster_name]]
                                 for c in (pipeline.actor_train, pipeline.critic)}
        result["integration_facts"] = {c.cluster_name: c.integration_facts(blocking=True)
                                       for c in (pipeline.actor_train, pipeline.critic)}
        handle = pipeline.actor_train.workers[0]
        result["ray_version"] = ray.__version__
        result["actor_handle_has___ray_call__"] = getattr(handle, "__ray_call__", None) is not None
        result["__ray_call___works"] = ray.get(handle.__ray_call__.remote(lambda w: type(w).__name__), timeout=60)
        event("pipeline initialized")
        pipeline.run()
        event("run() returned")
        if a.integration and a.wait_commit is not None:
            # the launch ends right after an asynchronous save: wait for it to commit (what a real
            # launch, whose last step saves synchronously, never needs)
            path = os.path.join(cfg.checkpoint_config["output_dir"], f"checkpoint-{a.wait_commit}", "manifest.json")
            result["committed_when_run_returned"] = os.path.exists(path)
            deadline = time.monotonic() + 120
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.2)
            result["committed_after_wait"] = os.path.exists(path)
        if not a.integration:  # ROLL's uploads are asynchronous: wait until every staging folder is gone
            pipeline.executor.shutdown(wait=True)
            deadline = time.monotonic() + 120
            out = os.path.join(a.workdir, "output")

            def staged() -> list:
                return [os.path.join(d, n) for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))
                        for n in os.listdir(os.path.join(out, d)) if n.startswith("checkpoint-")]

            while staged() and time.monotonic() < deadline:
                time.sleep(0.2)
            result["roll_staging_left"] = staged()
            time.sleep(1.0)
        event("launch done")
    except BaseException as exc:
        result["exception"] = {"type": type(exc).__name__, "repr": repr(exc),
                               "traceback": traceback.format_exc(),
                               "exit_code": getattr(exc, "code", None),
                               "step": getattr(exc, "step", None), "path": getattr(exc, "path", None)}
        event(f"raised {type(exc).__name__}")
        if pipeline is not None:  # a preemption: the WorkerState its save wrote (do_checkpoint updated it first)
            result["state_at_exit"] = _jsonable(dataclasses.asdict(pipeline.state))
        pids = [p for ps in (result.get("worker_pids") or {}).values() for p in ps]
        deadline = time.monotonic() + 10  # the actors a preemption ends are given a moment
        while time.monotonic() < deadline and all(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.5)
        result["workers_alive_before_shutdown"] = {str(p): os.path.exists(f"/proc/{p}") for p in pids}
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        if not isinstance(exc, SystemExit):
            traceback.print_exc()
    finally:
        try:
            ray.shutdown()
        except BaseException as exc:  # noqa: BLE001
            result["shutdown_error"] = repr(exc)
        write()
    return code


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
