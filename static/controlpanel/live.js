// The dashboard's live feed: rows pushed by the server over a websocket replace the rows
// on the page in place. No polling: the only timer counts "seen N s ago" locally.
(function () {
  "use strict";

  function csrfToken() {
    var match = document.cookie.match(/(?:^|; )csrftoken=([^;]+)/);
    return match ? decodeURIComponent(match[1]) : "";
  }

  // Rows pushed by the live feed are rendered without a request, so their forms carry no
  // CSRF token; the page's own cookie supplies it at submit time.
  document.addEventListener("submit", function (event) {
    var form = event.target;
    var question = form.dataset.confirm;
    if (question && !window.confirm(question)) {
      event.preventDefault();
      return;
    }
    if (form.method.toLowerCase() !== "post") return;
    var field = form.querySelector("input[name=csrfmiddlewaretoken]");
    if (!field) {
      field = document.createElement("input");
      field.type = "hidden";
      field.name = "csrfmiddlewaretoken";
      form.appendChild(field);
    }
    if (!field.value) field.value = csrfToken();
  });

  function renderAges() {
    var now = Date.now() / 1000;
    document.querySelectorAll("[data-since]").forEach(function (el) {
      var age = Math.max(0, Math.round(now - parseFloat(el.dataset.since)));
      el.textContent = age < 90 ? age + " s ago" : Math.round(age / 60) + " min ago";
    });
    // A rollout step's hold, counted down here; the server says when it moves on.
    document.querySelectorAll("[data-until]").forEach(function (el) {
      var left = Math.round(parseFloat(el.dataset.until) - now);
      if (left <= 0) el.textContent = "over, checking gates";
      else el.textContent = (left < 90 ? left + " s" : Math.round(left / 60) + " min") + " left";
    });
  }
  renderAges();
  setInterval(renderAges, 1000);

  var tbody = document.getElementById("fleet-rows");
  var status = document.getElementById("live-status");
  var plansBody = document.getElementById("rollout-rows");
  var plansPanel = document.getElementById("rollout-panels");
  var eventRows = document.getElementById("event-rows");
  if (!status || !(tbody || plansBody || plansPanel || eventRows)) return;
  var singleRow = tbody && tbody.dataset.live === "single";

  function setStatus(text, state) {
    status.hidden = false;
    status.textContent = text;
    status.className = "live live-" + state;
  }

  function rowFromHtml(html) {
    var holder = document.createElement("tbody");
    holder.innerHTML = html.trim();
    return holder.firstElementChild;
  }

  function elementFromHtml(html) {
    var holder = document.createElement("div");
    holder.innerHTML = html.trim();
    return holder.firstElementChild;
  }

  // A plan's fragment rendered before the page was loaded can arrive after it (a pause's,
  // after the resume's reload): each transition bumps the plan's version, and an older
  // fragment never replaces a newer one.
  function replaceIfCurrent(old, fresh) {
    if (Number(fresh.dataset.version || 0) >= Number(old.dataset.version || 0)) {
      old.replaceWith(fresh);
    }
  }

  function applyRollouts(plans) {
    Object.keys(plans).forEach(function (id) {
      var row = document.getElementById("rollout-row-" + id);
      if (row) replaceIfCurrent(row, rowFromHtml(plans[id].row));
      else if (plansBody) plansBody.insertBefore(rowFromHtml(plans[id].row), plansBody.firstChild);
      var panel = document.getElementById("rollout-panel-" + id);
      if (panel) replaceIfCurrent(panel, elementFromHtml(plans[id].panel));
    });
  }

  // A button pressed while the feed replaces its row or panel loses its click: mousedown
  // lands on the old button, mouseup on the new one. While a pointer is down, messages wait
  // and are applied in order once it is released, after the click has gone to the button
  // (data-held on the status says how many wait).
  var pressed = false;
  var held = [];

  function hold(message) {
    held.push(message);
    status.dataset.held = held.length;
  }

  function release() {
    pressed = false;
    // After the click this release belongs to, which the browser sends after pointerup.
    setTimeout(function () {
      if (pressed) return;
      var waiting = held.splice(0);
      delete status.dataset.held;
      waiting.forEach(apply);
    }, 0);
  }

  document.addEventListener("pointerdown", function () { pressed = true; }, true);
  document.addEventListener("pointerup", release, true);
  document.addEventListener("pointercancel", release, true);
  window.addEventListener("blur", release);

  function receive(message) {
    if (pressed) hold(message);
    else apply(message);
  }

  function apply(message) {
    if (message.rollouts) applyRollouts(message.rollouts);
    if (tbody && message.rows) applyFleet(message);
    renderAges();
    // Other pages' scripts (events.js) read the rest of the message.
    document.dispatchEvent(new CustomEvent("live:message", { detail: message }));
  }

  function applyFleet(message) {
    // A row pushed by the feed is new markup: keep the operator's selection across it.
    var picked = {};
    tbody.querySelectorAll("input[name=worker]:checked").forEach(function (box) { picked[box.value] = true; });
    Object.keys(message.rows).forEach(function (id) {
      var fresh = rowFromHtml(message.rows[id]);
      var current = document.getElementById("worker-" + id);
      if (current) current.replaceWith(fresh);
      else if (!singleRow) tbody.appendChild(fresh);
    });
    message.removed.forEach(function (id) {
      var gone = document.getElementById("worker-" + id);
      if (gone && !singleRow) gone.remove();
    });
    if (!singleRow) {
      if (message.full) {
        Array.from(tbody.children).forEach(function (row) {
          if (message.order.indexOf(parseInt(row.dataset.workerId, 10)) < 0) row.remove();
        });
      }
      message.order.forEach(function (id) {
        var row = document.getElementById("worker-" + id);
        if (row) tbody.appendChild(row);
      });
      var totals = document.getElementById("model-totals");
      if (totals && message.totals) totals.outerHTML = message.totals;
      var problems = document.getElementById("problems");
      if (problems && message.problems) problems.outerHTML = message.problems;
      var count = document.getElementById("worker-count");
      if (count) count.textContent = message.order.length;
      var empty = document.getElementById("fleet-empty");
      if (empty) empty.hidden = message.order.length > 0;
    }
    tbody.querySelectorAll("input[name=worker]").forEach(function (box) { box.checked = !!picked[box.value]; });
    document.dispatchEvent(new CustomEvent("fleet:updated"));
  }

  var retryDelay = 500;
  var everConnected = false;
  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var socket = new WebSocket(scheme + location.host + "/ws/fleet/");
    socket.onopen = function () {
      retryDelay = 500;
      setStatus(everConnected ? "Live · reconnected" : "Live", "ok");
      everConnected = true;
    };
    socket.onmessage = function (event) { receive(JSON.parse(event.data)); };
    socket.onclose = function (event) {
      if (event.code === 4401 || event.code === 4403) {
        setStatus("Not live: log in again", "down");
        return;
      }
      setStatus("Reconnecting…", "down");
      setTimeout(connect, retryDelay);
      retryDelay = Math.min(retryDelay * 2, 5000);
    };
  }
  connect();
})();
