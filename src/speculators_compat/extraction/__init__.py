"""What runs when the generator extracts: the caller-side driver, the worker-side capture
state, the protocol between them, the exchange memory and the errors. Patch declarations and
probes stay in ``speculators_compat.patches``; nothing here patches anything.

    protocol.py   the RPC between driver and workers (ops, their arguments, replies, fencing)
    driver.py     ``generate``: validate input, lease exchange memory, step the engine, verify
    steps.py      the step loop (serial and pipelined), one timing/clean-up core
    capture.py    the worker side: hooks' row placement, exchange mapping, written-row counts
    inputs.py     token-id and layer-id validation (one-line ValueErrors)
    errors.py     ExtractionError, worker health, exception descriptions
"""
