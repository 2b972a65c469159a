# One image for both services; compose.yaml gives each container its command.
#   docker build -t ddtree-serve:latest .
#   docker run --rm ddtree-serve:latest                      # prints usage
#   docker run --rm --gpus all -v /path/models:/models:ro -p 50051:50051 ddtree-serve:latest \
#       python -m verifier_svc --target /models/target --draft /models/draft --host 0.0.0.0
# See docs/deploy.md.

# PyTorch's own CUDA runtime image (Ubuntu 22.04, Python 3.11 in /opt/conda): torch, triton
# and the CUDA/cuDNN libraries come from here. Pinned; override with --build-arg BASE_IMAGE=.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /app

# Keep the base image's torch (a CUDA build) and triton: record their exact versions as pip
# constraints, so that resolving the project's dependencies can never replace them (torch>=2.5
# would otherwise be free to pull a different wheel from PyPI).
RUN python -c "import sys; assert sys.version_info >= (3, 11), sys.version" \
 && pip list --format=freeze 2>/dev/null | grep -iE '^(torch|triton)==' > /etc/pip-constraints.txt \
 && grep -qi '^torch==' /etc/pip-constraints.txt \
 && python -c "import torch; print(torch.__version__, torch.version.cuda)" > /etc/base-torch.txt \
 && cat /etc/pip-constraints.txt /etc/base-torch.txt

# Dependencies first (their layer survives source edits): the [project] dependencies of
# pyproject.toml, installed under the constraints above.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install --no-cache-dir -c /etc/pip-constraints.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# The project itself. `models/` is not copied: checkpoints are mounted at run time.
COPY common ./common
COPY ddtree_kernels ./ddtree_kernels
COPY drafter_svc ./drafter_svc
COPY verifier_svc ./verifier_svc
COPY protos ./protos
COPY scripts ./scripts
RUN pip install --no-cache-dir --no-deps -c /etc/pip-constraints.txt . \
 && rm -rf build ./*.egg-info

# /app first on the path, so the source tree (including common/gen, the generated gRPC code)
# is what gets imported, whatever the wheel's package list holds.
ENV PYTHONPATH=/app

# Fail the build, not the deployment: torch is still the base image's CUDA build, the gRPC,
# protobuf and OpenTelemetry pieces import, and both entry points answer --help.
RUN python -c "import torch; got = f'{torch.__version__} {torch.version.cuda}'; want = open('/etc/base-torch.txt').read().strip(); assert got == want, f'torch changed: {want} -> {got}'; assert torch.version.cuda, 'torch has no CUDA'" \
 && python -c "import grpc, grpc_health.v1.health_pb2, grpc_reflection.v1alpha.reflection, opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.grpc.trace_exporter, common.gen.ddtree.v1.ddtree_pb2" \
 && python -m verifier_svc --help > /dev/null \
 && python -m drafter_svc --help > /dev/null \
 && python scripts/grpc_health_probe.py --help > /dev/null

# Unprivileged user; its home holds the Triton kernel cache.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin ddtree
USER ddtree

# 50050: drafter (public ddtree.v1.Generation API); 50051: verifier (internal).
EXPOSE 50050 50051

CMD ["python", "-c", "print('ddtree-serve image: give a command, e.g.\\n  python -m verifier_svc --target /models/target --draft /models/draft --host 0.0.0.0 --port 50051\\n  python -m drafter_svc --draft /models/draft --target /models/target --verifier HOST:50051 --port 50050\\n  python scripts/grpc_health_probe.py --addr HOST:PORT\\nSee docs/deploy.md; compose.yaml runs both.')"]
