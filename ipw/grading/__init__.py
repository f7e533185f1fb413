"""Grading: answers scored (``scoring``: deterministic scorers) and judged (``judge``: a backend grades with a
versioned prompt; ``spec``: a judge's grading as data, below the config and analysis), and a saved run scored
again into a linked run folder (``rescore``)."""
