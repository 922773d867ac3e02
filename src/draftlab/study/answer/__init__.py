"""The answer side of a study: everything read back from a study's store, never measured.

The per-cell summaries (`summary`, `report`, `host`), the answer and the deploy line (`recommend`, `serving`), the
tables (`tables`, `weight_types`, `learning`), the seeds' findings (`findings`), the figures (`plots`), the
acceptance carried to a tuner (`transfer`), and the sections the terminal and the HTML page print (`sections`,
`page`). A report can be rebuilt from the database alone, on any machine.
"""
