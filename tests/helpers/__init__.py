"""Helpers shared by the whole test suite (import them as ``helpers.<module>``).

* :mod:`helpers.launch`   - the environment of the processes tests start, free ports, the one
  bounded ``torchrun`` launcher and the environment of a rank forked by hand;
* :mod:`helpers.training` - config builders and the one training step of the tests' small jobs;
* :mod:`helpers.plugins`  - a plugin manager with one extra backend, and the test-fixture
  backend distribution (``tests/plugins/example_backend``) installed for a test run only;
* :mod:`helpers.forkserver` - the fork server the crash and component tests start workers from;
* :mod:`helpers.warm`     - a ``subprocess.Popen`` whose child is forked from a warm interpreter
  (``_warm_server.py``), and whose own python children are forked from it in turn;
* :mod:`helpers.ranks`    - ranks as ``torchrun --standalone`` starts them, and their supervision
  as its agent does (the tests' agent: ``_rank_agent.py``).

``tests/`` is on ``sys.path`` under pytest (its rootdir conftest, ``tests/conftest.py``); the
processes tests start get it on ``PYTHONPATH`` from :func:`helpers.launch.child_env`, so
child scripts import these modules too.
"""
