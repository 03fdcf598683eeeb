#include "worker/worker_options.h"

#include "absl/strings/str_cat.h"

namespace epserve::worker {

absl::StatusOr<DeviceExchangeMode> ParseDeviceExchangeMode(absl::string_view name) {
  if (name == "auto") return DeviceExchangeMode::kAuto;
  if (name == "off") return DeviceExchangeMode::kOff;
  if (name == "host") return DeviceExchangeMode::kHost;
  if (name == "cuda") return DeviceExchangeMode::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("--device-exchange must be auto, off, host or cuda; got '", name, "'"));
}

const char* DeviceExchangeModeName(DeviceExchangeMode mode) {
  switch (mode) {
    case DeviceExchangeMode::kAuto:
      return "auto";
    case DeviceExchangeMode::kOff:
      return "off";
    case DeviceExchangeMode::kHost:
      return "host";
    case DeviceExchangeMode::kCuda:
      return "cuda";
  }
  return "?";
}

absl::StatusOr<AutoSwitch> ParseAutoSwitch(absl::string_view flag, absl::string_view name) {
  if (name == "auto") return AutoSwitch::kAuto;
  if (name == "on") return AutoSwitch::kOn;
  if (name == "off") return AutoSwitch::kOff;
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be auto, on or off; got '", name, "'"));
}

const char* AutoSwitchName(AutoSwitch mode) {
  switch (mode) {
    case AutoSwitch::kAuto:
      return "auto";
    case AutoSwitch::kOn:
      return "on";
    case AutoSwitch::kOff:
      return "off";
  }
  return "?";
}

absl::Status WorkerOptions::Validate() const {
  if (host_threads < 0 || host_threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-host-threads must be in [0, 256], got ", host_threads));
  }
  if (idle_poll < absl::ZeroDuration() || idle_poll > absl::Milliseconds(100)) {
    return absl::InvalidArgumentError(absl::StrCat("--worker-idle-poll must be in [0, 100ms], got ",
                                                   absl::FormatDuration(idle_poll)));
  }
  const int rows = device.mma_decode_rows;
  if (rows != 0 && rows != 32 && rows != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--mma-decode-rows must be 0, 32 or 64, got ", rows));
  }
  return absl::OkStatus();
}

}  // namespace epserve::worker
