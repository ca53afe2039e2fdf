"""Speed switches (optional reading: none changes what a run computes): the ``speed:`` settings (``switches``),
host memory kept between CPU steps (``host_memory``), Lightning's hooks without their profiling contexts
(``profiler``). Each is named in the start line when on, and set for the run only.
"""
