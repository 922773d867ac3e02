"""The run side of a study: the grid and its presets (`config`), the cells (`cells`), the records' store (`store`),
one cell on one prompt (`runner`), the host's pilot and the budget's plan (`budget`, `pacing`), the race that drops
trailing cells (`race`), engines that crash (`crashes`), the sweep's loop (`sweep`, `sweep_state`) and the baseline's
drift (`drift`), which the sweep paces by and the answer reports.

It plans and measures; it never imports `draftlab.study.answer`.
"""
