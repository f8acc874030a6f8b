"""Running vLLM engines: the launch spec, the process supervisor, the engine client and the
node agent that ties them to the database."""
