"""Tools above the library: offline jobs that compose models, evaluation tasks and integrations.

- :mod:`kvtrim.tools.search_patterns`: the MInference pattern search behind
  ``kvtrim search-patterns`` (one calibration prompt -> a per-model pattern config).

Nothing below this package (kernels, policies, the cache, integrations) imports it; see
``docs/architecture.md``.
"""
