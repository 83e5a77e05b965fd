"""`flashllm plan`: machine profile, cost model, predictor replay and the placement solver."""
