"""An OpenAI-compatible HTTP server over the engine (`python -m dspine_train.serving`).

`app.py` holds the routes, `protocol.py` the request bodies and response shapes, `batcher.py`
the scheduler that batches concurrent requests into one engine call, `detokenize.py` the
incremental decoding of streamed tokens, `metrics.py` the Prometheus metrics and `cli.py` the
command line. See docs/SERVING.md.
"""
