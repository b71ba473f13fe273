"""roll-ckpt's benchmarks, one package.

    python -m bench [--quick|--full|--smoke] [--check] [--groups ...] [--out DIR]   (bench.run)
    python -m bench.<name> [...]    scale, scale_jobs, recovery, hf_weights, incremental, soak, resume_ab

Run from the repository root, or with it on ``PYTHONPATH``. What a benchmark starts
(torchrun workers, the scale cells, the recovery and scale jobs) is started the same way,
``-m bench.<name>`` from the repository root (:mod:`bench.launch`), whatever the caller's
working directory. Results go to ``bench/results/`` (build output, not in git); the
summaries the documentation shows are copied to ``docs/benchmark/``.
"""
