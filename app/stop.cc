#include "app/stop.h"

#include <unistd.h>

#include <csignal>

namespace epserve::app {
namespace {

StopState g_stop;

void OnSignal(int, siginfo_t* info, void*) {
  if (info != nullptr && info->si_pid == getppid()) g_stop.by_launcher.store(true);
  g_stop.requested.store(true);
}

}  // namespace

StopState& Stop() { return g_stop; }

void InstallStopHandlers() {
  struct sigaction sa {};
  sa.sa_sigaction = OnSignal;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

}  // namespace epserve::app
