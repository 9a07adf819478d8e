# The chipledger image used by docker-compose.yml: the package and its pinned dependencies, with the ledger
# core compiled by mypyc (scripts/build_core.py; the compiler is removed again after the build).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY chipledger ./chipledger
COPY ledger ./ledger
COPY streams ./streams
COPY schemas ./schemas
COPY analytics ./analytics
COPY store ./store
COPY scripts/build_core.py ./scripts/build_core.py
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install --no-cache-dir -c requirements.lock '.[core]' \
 && python scripts/build_core.py --require \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
VOLUME /data
ENTRYPOINT []
CMD ["chipledger", "--help"]
