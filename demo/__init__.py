"""``kvpool demo``: several engines share one pool, live, against a static split.

Each engine is a small decoder whose keys and values live in kvpool tensors.
The engines serve a bursty request trace concurrently; each request is
admitted with ``await alloc(blocks)`` for its prompt plus its generation
budget, so a burst *waits* for memory instead of failing. While the pool
makes an engine lend (it holds more than its guarantee while a neighbour
below its own waits), the engine preempts its newest requests as vLLM does
when its cache is full: frees their blocks and recomputes them later. The
same trace is then served again with every engine capped at an equal slice
of the same pool: the static split engines use today.

Shipped in the kvpool wheel from the source folder ``demo/``, as
``kvpool/adapters`` is from ``adapters/``; the library never imports it
(``kvpool/cli.py`` does, lazily, for ``kvpool demo``). This file imports
nothing, so a module of the package loads only what it needs (``report``
and ``traces`` load no torch). The modules, each importing only those
listed before it:

==============  ==========================================================
``traces``      request traces from a seed (``--trace``)
``clock``       the real clock, and the virtual clock's event loop
``model``       the tiny decoder and its paged and contiguous KV caches
``sched``       admission and preemption, shared by both clocks' engines
``report``      the summary table and the plot (no torch)
``common``      what both clocks share: pool sizes, headroom, a mode's figures
``realtime``    the real engines: one loop, or one process each
``virtual``     the engines with modeled step times on a virtual clock
``sweep``       the virtual demo at several bursts (``--sweep``)
``cli``         the options, both modes in turn, the live table, the summary
``__main__``    ``python -m kvpool.demo --worker``: one engine process
==============  ==========================================================
"""
