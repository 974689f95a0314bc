# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Grid World Environment - A simple test environment for HTTP server."""

from .client import GridWorldEnv
from .models import GridWorldAction, GridWorldObservation

__all__ = ["GridWorldAction", "GridWorldObservation", "GridWorldEnv"]
