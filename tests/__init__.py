# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The test tree as a package, so its shared code imports by name: ``tests.support``
(see its docstring) and the golden recordings' loader ``tests.data.golden.golden_io``.

The test directories (core, vllm, safety, cuda, gpu) stay plain directories: pytest
imports their files by basename (``--import-mode=prepend``), and no test module imports
another. The repository root is on ``sys.path`` through ``pythonpath = ["."]`` in
pyproject.toml's ``[tool.pytest.ini_options]`` (scripts launched by the tests get it from
:func:`tests.support.worker_env`).

Why ``tests`` and not ``tests/`` itself on the path (``from support import ...``): a
directory on ``sys.path`` makes each subdirectory an importable namespace package, and
``tests/vllm`` would then answer ``import vllm`` wherever vLLM is not installed (a lent GPU
box: ``importlib.util.find_spec("vllm")`` would find it).
"""
