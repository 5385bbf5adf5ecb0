"""The generated tables of README and docs/, one module per benchmark topic.

Each module renders its tables from the JSON under ``docs/results/`` and exports ``TABLES``: block name (the
``<!-- figures:NAME -->`` marker) -> function of the results folder. `visualkv.bench.figures` writes them into the
documents.
"""
