"""A served engine behind `ChatSession`: an OpenAI-compatible server (llama.cpp's server,
vLLM, SGLang) streams the answer, and its replies become the same typed events the
in-process engine yields (`events.py`).

- `client`: HTTP and server-sent events to the one address the user gave;
- `engines`: which server it is, and the speculation counts each one reports;
- `backend`: the session side, a stream turned into events and stats;
- `local_server`: llama.cpp's server started on 127.0.0.1 with a draft and its own key, and stopped;
- `loopback`: a server process started here, reached directly and proved to hold its port.
"""
