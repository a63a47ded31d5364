# The image behind the coordinator and worker services of docker-compose.yml.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# bubblewrap: a sandbox per step (OVERNIGHT_SANDBOX=bwrap, the default); a container running
# steps needs the security options of docker-compose.yml's worker service.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY config ./config
COPY coordinator ./coordinator
COPY worker ./worker
COPY src ./src
RUN pip install .
# overnight runs as root in the container (it makes a cgroup per step); every agent step and
# verifier rule runs as this unprivileged user, which owns nothing of overnight's.
RUN useradd --system --no-create-home --shell /usr/sbin/nologin overnight-step
ENV OVERNIGHT_STEP_USER=overnight-step
WORKDIR /tasks
CMD ["overnight", "--help"]
