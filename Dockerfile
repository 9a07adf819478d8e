# The chipledger image used by docker-compose.yml: the package and its pinned dependencies.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY chipledger ./chipledger
COPY ledger ./ledger
COPY streams ./streams
COPY schemas ./schemas
COPY analytics ./analytics
RUN pip install --no-cache-dir -c requirements.lock .
VOLUME /data
ENTRYPOINT []
CMD ["chipledger", "--help"]
