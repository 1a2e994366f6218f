"""What runs when the generator extracts; nothing here patches anything (that is ``patches``).

    protocol.py   the RPC between driver and workers (ops, their arguments, replies, fencing)
    driver.py     ``generate``: validate input, lease exchange memory, step the engine, verify
    steps.py      the step loop (serial and pipelined), one timing/clean-up core
    capture.py    the worker side: hooks' row placement, exchange mapping, written-row counts
    inputs.py     token-id and layer-id validation (one-line ValueErrors)
    errors.py     ExtractionError, worker health, exception descriptions
"""
