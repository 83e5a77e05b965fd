"""Low-rank activation predictors: calibration data collection (collect), training (train) and
evaluation (evaluate) behind `flashllm predictors train|eval`. See README.md in this directory."""
