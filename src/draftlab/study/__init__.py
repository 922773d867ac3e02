"""The study: sweeps over target x engine x draft x K x dataset x temperature into a resumable SQLite store, and
the answer read back from it.

Two packages, one direction: `draftlab.study.run` plans and measures (it writes the store); `draftlab.study.answer`
reads the store and tells (the answer, the tables, the HTML page). The answer side imports the run side's record
types; the run side never imports the answer side (tests/test_structure.py checks it).
"""
