"""The compatibility matrix: the whole suite on each supported stack (``make test-matrix``).

Each leg is a Python, a torch, a transformers, a NumPy and a Ray release that real jobs run
(:mod:`matrix.legs`). :mod:`matrix.run` builds one virtual environment a leg with pip
(``.matrix/<leg>/``), runs the whole suite in it and records the counts, the skips and the
time in ``matrix/results/<leg>.json``, from which ``docs/compatibility.md``'s table is made.
``roll_ckpt.runtime.torch_compat.CHECKED_ON`` and ``transformers_compat.CHECKED_ON`` must
name the releases of the legs that passed (``tests/core/test_compat_seams.py``).

Standard library only: it runs on the machine's Python before any venv exists.
"""
