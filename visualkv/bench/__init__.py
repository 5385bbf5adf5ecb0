"""Benchmarks and demo scenes, apart from the library core.

cli.py (`python -m visualkv bench ...`: memory, latency, fidelity, salicache, one, report), gpu.py (`bench gpu`),
needle.py (`bench needle`), scenes.py (needle scenes and questions), synthetic.py (deterministic images and
videos), demo_examples.py (the demo model's examples), provenance.py (command, machine and load recorded in
every result), figures.py (README / docs tables from the committed results).
"""
