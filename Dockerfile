# The image behind the coordinator and worker services of docker-compose.yml.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY config ./config
COPY coordinator ./coordinator
COPY worker ./worker
COPY overnight ./overnight
RUN pip install .
WORKDIR /tasks
CMD ["overnight", "--help"]
