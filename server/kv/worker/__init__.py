"""The connector's worker side (one per tensor-parallel rank): moves bytes, with torch.

- :mod:`.worker`: ``SessionKVWorker``, which executes each step's ``StepPlan`` and reports back
  (``WorkerReport``);
- :mod:`.layer_loads`: the copy thread, a step's RAM loads layer by layer during the forward;
- :mod:`.io_thread`, :mod:`.io_queue`: the I/O thread and its queue (disk and Redis).

It never imports the scheduler side or the registry: the plan and the report
(:mod:`server.kv.metadata`) are the whole interface.
"""
