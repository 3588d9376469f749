// Byte counts as people read them, the one formatter for every message and
// table (native errors, and Python's through kvpool._sizes): binary units
// with one decimal ("128.0 MiB", "1.0 PiB"), the exact count added where the
// short form rounds ("11.8 MiB (12345678 bytes)"), since a limit or a
// capacity an operator compares against what they typed must be exact.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvpool {

inline std::string format_size(int64_t bytes) {
    static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    // |INT64_MIN| does not fit an int64: take the magnitude as unsigned.
    const uint64_t mag = bytes < 0 ? 0 - static_cast<uint64_t>(bytes) : static_cast<uint64_t>(bytes);
    const char* sign = bytes < 0 ? "-" : "";
    if (mag < 1024) return sign + std::to_string(mag) + " B";
    int unit = 0;
    double v = static_cast<double>(mag);
    // Up a unit while the value rounds to 1024.0 or more ("1024.0 KiB" reads as "1.0 MiB").
    while (unit < 6 && v >= 1023.95) {
        v /= 1024.0;
        ++unit;
    }
    char buf[48];
    std::snprintf(buf, sizeof(buf), "%s%.1f %s", sign, v, kUnits[unit]);
    return buf;
}

// format_size, with the exact byte count where the short form is not exact.
inline std::string format_size_exact(int64_t bytes) {
    const std::string short_form = format_size(bytes);
    const uint64_t mag = bytes < 0 ? 0 - static_cast<uint64_t>(bytes) : static_cast<uint64_t>(bytes);
    if (mag < 1024) return short_form;
    // The unit format_size picked; its tenths are exact only at multiples of
    // half a unit (a tenth of 2**k bytes is not a whole number of bytes).
    uint64_t unit = 1;
    while (unit < (uint64_t{1} << 60) && static_cast<double>(mag) / static_cast<double>(unit) >= 1023.95) unit *= 1024;
    const bool exact = mag % (unit / 2) == 0;
    return exact ? short_form : short_form + " (" + std::to_string(bytes) + " bytes)";
}

}  // namespace kvpool
