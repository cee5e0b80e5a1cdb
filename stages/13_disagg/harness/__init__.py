"""Harnesses: code that drives, measures or stands in for the engine, and is not the engine.

A harness is a simulation, a cost model, a fake transport, a test peer or a benchmark helper.
The tests, the notebooks and the stage's bench.py import it; the engine's modules never do, and
no configuration of the engine reaches it. A harness imports the engine (`from .. import x`)
to drive it, so reading the engine means reading the stage folder without this one.
"""
