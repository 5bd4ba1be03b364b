// The worker page's charts: a readout of the time and every line's value under the pointer.
// The server drew the chart (console.charts) and put each slot's time label, x and y in
// data-chart, so this only finds the nearest slot with a reading; it knows no time zone.
// About once a probe the page fetches itself and swaps in the charts drawn from the newer
// history (not while the pointer is on one: the readout would jump under it).
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var REACH = 6; // slots either side searched for a reading before saying nothing

  function nearest(data, x) {
    var xs = data.xs, best = -1, bestGap = Infinity;
    for (var i = 0; i < xs.length; i++) {
      var known = data.lines.some(function (line) { return line.values[i] !== null; });
      var gap = Math.abs(xs[i] - x);
      if (known && gap < bestGap) { best = i; bestGap = gap; }
    }
    var slot = (xs[xs.length - 1] - xs[0]) / (xs.length - 1);
    return bestGap <= REACH * slot ? best : -1;
  }

  function format(value, unit) {
    if (value === null) return "unknown";
    var text = Number.isInteger(value) ? String(value) : Math.abs(value) >= 100 ? value.toFixed(0) : Math.abs(value) >= 10 ? value.toFixed(1) : value.toFixed(2);
    if (!unit) return text;
    return unit === "%" || unit === "°C" ? text + unit : text + " " + unit;
  }

  function setUp(figure) {
    var data = JSON.parse(figure.dataset.chart);
    var svg = figure.querySelector("svg");
    var cursor = svg.querySelector("line.cursor");
    var readout = figure.querySelector(".readout");
    var dots = data.lines.map(function (line) {
      var dot = document.createElementNS(SVG, "circle");
      dot.setAttribute("r", "3");
      dot.setAttribute("class", "dot");
      dot.style.stroke = getComputedStyle(svg.querySelector("polyline." + line.css) || svg).stroke;
      dot.setAttribute("visibility", "hidden");
      svg.appendChild(dot);
      return dot;
    });

    function hide() {
      cursor.setAttribute("visibility", "hidden");
      dots.forEach(function (dot) { dot.setAttribute("visibility", "hidden"); });
      readout.hidden = true;
    }

    function show(event) {
      var box = svg.getBoundingClientRect();
      var x = (event.clientX - box.left) / box.width * data.width;
      var i = x < data.x0 - 4 || x > data.x1 + 4 ? -1 : nearest(data, x);
      if (i < 0) { hide(); return; }
      cursor.setAttribute("x1", data.xs[i]);
      cursor.setAttribute("x2", data.xs[i]);
      cursor.setAttribute("visibility", "visible");
      readout.textContent = "";
      var when = document.createElement("b");
      when.textContent = data.times[i];
      readout.appendChild(when);
      data.lines.forEach(function (line, n) {
        var row = document.createElement("div");
        var key = document.createElement("i");
        key.className = line.css;
        row.appendChild(key);
        row.appendChild(document.createTextNode(line.label + ": " + format(line.values[i], line.unit)));
        readout.appendChild(row);
        var y = line.ys[i];
        dots[n].setAttribute("visibility", y === null ? "hidden" : "visible");
        if (y !== null) { dots[n].setAttribute("cx", data.xs[i]); dots[n].setAttribute("cy", y); }
      });
      readout.hidden = false;
      // Keep the readout inside the box: right of the cursor, or left of it past the middle.
      var px = data.xs[i] / data.width * box.width;
      if (px > box.width / 2) { readout.style.left = ""; readout.style.right = (box.width - px + 10) + "px"; }
      else { readout.style.right = ""; readout.style.left = (px + 10) + "px"; }
    }

    svg.addEventListener("mousemove", function (event) { hovering = true; show(event); });
    svg.addEventListener("mouseleave", function () { hovering = false; hide(); });
  }

  var hovering = false;
  document.querySelectorAll("figure[data-chart]").forEach(setUp);

  function redraw() {
    if (document.hidden || hovering) return;
    fetch(location.href, { credentials: "same-origin" })
      .then(function (answer) { return answer.ok && !answer.redirected ? answer.text() : ""; })
      .then(function (html) {
        if (!html) return;
        var page = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-charts]").forEach(function (box) {
          var fresh = page.getElementById(box.id);
          if (!fresh) return;
          box.replaceWith(fresh);
          fresh.querySelectorAll("figure[data-chart]").forEach(setUp);
        });
      })
      .catch(function () { /* the next round tries again */ });
  }

  var first = document.querySelector("[data-charts][data-refresh-ms]");
  if (first) setInterval(redraw, parseInt(first.dataset.refreshMs, 10) || 5000);
})();
