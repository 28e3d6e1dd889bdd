# A small CPU stand-in for NVIDIA's PyTorch image, which docker/check.sh builds aiak's image on where no GPU and
# no registry are at hand. It has what docker/Dockerfile relies on in NGC's image: a `python` and `pip` on PATH
# whose environment already holds torch, so the recipe's constraint step has a torch to freeze. DEBIAN_ROOTFS is
# a Debian image check.sh made with mmdebstrap (python3, python3-venv, ca-certificates) and imported locally.
ARG DEBIAN_ROOTFS
FROM ${DEBIAN_ROOTFS}

# pip reads its sources (a wheel folder, a local index, a CA bundle) from /etc/pip.conf, which check.sh mounts
# into the build; nothing of it stays in the image.
ARG TORCH=torch==2.13.0+cpu
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir "$TORCH"

ENV PATH=/opt/venv/bin:$PATH
