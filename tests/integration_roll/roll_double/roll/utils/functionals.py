"""Stands in for roll/utils/functionals.py: ``reduce_metrics`` (lists reduced with the mean;
scalars left as they are). Not ROLL's code."""

import numpy as np


def reduce_metrics(metrics: dict, reduce_func=np.mean) -> dict:
    for key, value in metrics.items():
        if isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0:
            metrics[key] = reduce_func(value)
    return metrics
