"""Accuracy on public benchmarks: ``python -m visualkv eval``.

One module per benchmark reader (its release layout, official prompt and answer extraction: ``videomme``,
``mlvu``, ``vstar``, ``hrbench``, named in ``benchmarks``); ``items`` (the item every reader yields, file
reading with one-line errors); ``choices`` (option-text matching shared by the readers); ``ranks`` (rank,
shard and barrier from the launcher's environment); ``store`` (crash-safe JSON lines, resumption, the merge);
``runner`` (one compressed turn per item, method and budget); ``summary`` (accuracy tables, accuracy-vs-KV
chart).
"""
